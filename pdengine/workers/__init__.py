"""PD workers: the prefill side computes prompts and pushes KV pages, the decode side
receives them, decodes and streams (see each module's lifecycle docstring)."""

from pdengine.runtime.request_stream import RequestStream as DecodeStream
from pdengine.workers.common import WorkerOptions
from pdengine.workers.decode import DecodeWorker
from pdengine.workers.liveness import LivenessConfig, PeerMonitor
from pdengine.workers.peer_client import PeerClient, PeerError
from pdengine.workers.prefill import PrefillWorker

__all__ = [
    "DecodeStream",
    "DecodeWorker",
    "LivenessConfig",
    "PeerClient",
    "PeerError",
    "PeerMonitor",
    "PrefillWorker",
    "WorkerOptions",
]
