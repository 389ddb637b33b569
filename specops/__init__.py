"""specops: drive EAGLE-3 hidden-state extraction on remote GPU hosts from a laptop."""

__version__ = "0.1.0"
