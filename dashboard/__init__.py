"""Streamlit dashboard."""
