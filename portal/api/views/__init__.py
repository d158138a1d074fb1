"""The API's views: adapters that parse, check who may do it with the web UI's
rules (``Job.objects.visible_to``, ``Job.can_be_*_by``, the admin console's
permissions), call one ``scheduler.services`` verb and render the result."""
