"""The DAPO training loop and the stages of it that belong to no other folder; the step map: docs/architecture.md."""
