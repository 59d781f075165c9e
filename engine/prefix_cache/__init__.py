"""The prefix cache: cached row state of prompt prefixes, in memory and on disk."""
