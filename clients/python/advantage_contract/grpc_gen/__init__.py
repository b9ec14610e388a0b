"""Generated from proto/advantage/v1/advantage.proto by proto/generate.py; do not edit."""
