"""The Click commands and the typed build configs they fill."""
