"""Test and demo helpers; nothing here is imported by the plugin at runtime."""
