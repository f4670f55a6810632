"""Test support for the log's reliability tests: crafted log bytes and a system-call recorder."""
