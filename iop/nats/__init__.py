"""NATS for iop: credentials, the embedded server, connections, and the JetStream topology."""
