"""Bucket transports: one file per transport, each a trainer-side buffer and an engine-side opener."""
