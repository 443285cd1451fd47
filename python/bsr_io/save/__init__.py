"""The save path: records from a destination into a tier through the W slots."""
