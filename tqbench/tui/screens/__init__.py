"""Workbench screens and panes: Run, Policies, help, open session."""
