"""The judges of an iteration, one statistic each, behind one signature (``judges/base.py``)."""
