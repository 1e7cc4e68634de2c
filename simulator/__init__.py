"""meshplan simulator."""
