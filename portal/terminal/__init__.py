"""Terminals of interactive jobs in the browser and ``gpulab shell``: the
websocket relay between a viewer and the job's node agent (``consumers``)."""
