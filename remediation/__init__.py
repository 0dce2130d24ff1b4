"""The joint TP/PP/DP planner, baseline strategies, and the incident-to-command lifecycle."""
