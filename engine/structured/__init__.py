"""Structured output: constraint specs, grammar matchers and the token masks they yield."""
