"""Prediction of performance from hardware state: NCPP's group-attention regressor, the baselines it
must beat, and the metrics it is judged by.

A model is fitted offline with torch (`fit.py`, `rankwatch model fit`) and saved as one small file;
the collector evaluates it with numpy alone (`ncpp.py`), so it never imports torch."""
