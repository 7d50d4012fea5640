"""The HTTP API in front of the store and the queue (``comfy-assets api``): clients
submit jobs, follow them, fetch their files and get webhooks; workers render them from
the queue as they render ``enqueue``'s. See docs/api.md."""
