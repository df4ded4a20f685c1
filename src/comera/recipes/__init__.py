"""Workload recipes (model + data + loss + evaluation + tensorization + settings) and the run that trains
them: ``comera train WORKLOAD``. Importing this package registers every recipe."""
