"""meshplan apps."""
