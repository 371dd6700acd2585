"""Running requests: prefill and decode over cache views. Not for: HTTP (see :mod:`replaykv.server`)."""
