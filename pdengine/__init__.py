"""pdengine: a prefill/decode disaggregated LLM inference engine in which no request can be forgotten."""

__version__ = "0.1.0"
