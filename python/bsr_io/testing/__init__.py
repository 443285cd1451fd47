"""What tests, benchmarks and demos use to provoke and observe; the core never imports it."""
