"""Commands beside the service: the SFT warm start, the mismatch measurement, the soak, the metrics plot."""
