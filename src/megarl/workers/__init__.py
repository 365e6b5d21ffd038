"""Thin Ray actor classes, one per role: they host an engine or a server process for a worker
group and adapt it to calls from the controller. No algorithm or model logic lives here."""
