"""The RabbitMQ worker service: message sources, the broker, queue messages."""
