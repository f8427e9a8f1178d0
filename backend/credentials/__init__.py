"""Credentials: the encrypted vault they are kept in, and checking a Hub token before it is saved."""
