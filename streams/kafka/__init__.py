"""Kafka utilities of the stream worker: topic creation, the faust consumer transport and
connection, the history reader of a rebuild, topic followers. The stream core (`pipeline`,
`routing`, `ordering`, `progress`, `rebuild`) imports none of them."""
