"""Runnable experiments that check the paper's claims (``python -m validation.superlinear``)."""
