package target

// Redis Streams: XADD stream:<q> (relay/streams.go). Streams have no
// scheduler: jobs are claimed once due.
func init() {
	Register(Spec{
		Name:         "streams",
		Order:        3,
		Help:         "streams (Redis streams)",
		DueOnly:      true,
		StreamMaxLen: true,
		Length:       "XUNACKED",
		TraceSystem:  "redis",
		Goldens:      []string{"streams_entry.json", "streams_entry_tenant.json"},
	})
}
