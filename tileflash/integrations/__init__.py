"""Optional integrations with other libraries; each imports its library lazily and is never a runtime requirement."""
