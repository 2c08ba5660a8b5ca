"""telemetry package."""
