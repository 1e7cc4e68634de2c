"""meshplan runtime."""
