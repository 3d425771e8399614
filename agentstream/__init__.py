"""The ground every process links: the typed config schema (`config`) and the wire library (`wire`). Nothing here imports another part of the system."""
