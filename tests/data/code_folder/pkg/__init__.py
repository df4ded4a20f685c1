"""A small package."""
