"""Interactive jobs in the portal: the proxy to their JupyterLab (``proxy``),
who may open one (``access``), and the pages and form to start one (``views``)."""
