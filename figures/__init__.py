"""Figures and tables of the paper, drawn only from saved results (``python -m figures``)."""
