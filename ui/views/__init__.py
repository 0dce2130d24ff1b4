"""The console's pages; each module has one ``render`` function. (Not named ``pages/``: Streamlit
would turn such a folder next to app.py into its own multipage navigation.)"""
