"""The assistant tool world (PORTool's environment): seeded data, tools, and queries with reference plans."""
