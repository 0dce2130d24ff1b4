"""The torch trainer, its live-reshape executor, failure injection, and the cluster simulator."""
