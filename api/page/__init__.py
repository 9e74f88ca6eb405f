"""Pages for people, served by the API next to /v1: one incident's page and the offline /docs.

Everything a page shows is built here on the server (HTML and inline SVG, no script, no
asset from outside the app), so the page opens on an air-gapped cluster and in any
browser an on-call engineer has at hand. `svg` draws the plots, `incident` lays out the page,
`data` asks the store for what the page shows, `routes` serves it, `docs` serves Swagger UI
from files a pinned package ships.
"""
