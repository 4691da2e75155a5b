"""A worker's engine client: the native engine thread (``bridge``), its lifecycle and the requests' way to it
(``manager``), its output routed to each request's ``streams`` (``router``), and how the Flask app carries the
manager (``extension``)."""
