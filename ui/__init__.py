"""The Streamlit operators' console."""
