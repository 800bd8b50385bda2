"""panes"""
