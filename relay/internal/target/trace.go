package target

import (
	"bytes"
	"encoding/json"
)

// A staged job carries W3C trace context as two keys of its options,
// "traceparent" and, when there is one, "tracestate", both JSON strings.
// Each target puts them where its job system's OpenTelemetry
// instrumentation reads them (its file says where; relay/trace.go has the
// sources). A traceparent that is not a JSON string of the W3C form is
// dropped, with its tracestate: the job goes on without them, never poison.
const (
	TraceparentKey = "traceparent"
	TracestateKey  = "tracestate"
)

// ValidTraceparent reports whether s is a W3C traceparent that a
// propagator would accept: version-traceid-spanid-flags in lower-case hex,
// version not ff, ids not all zeros; version 00 is exactly 55 characters, a
// later version may have more after a '-'. It allocates nothing.
func ValidTraceparent(s string) bool {
	if len(s) < 55 || (len(s) > 55 && (s[:2] == "00" || s[55] != '-')) {
		return false
	}
	if s[2] != '-' || s[35] != '-' || s[52] != '-' || s[:2] == "ff" {
		return false
	}
	hex := func(p string) (zero bool, ok bool) {
		zero = true
		for i := 0; i < len(p); i++ {
			c := p[i]
			switch {
			case c >= '0' && c <= '9', c >= 'a' && c <= 'f':
			default:
				return false, false
			}
			if c != '0' {
				zero = false
			}
		}
		return zero, true
	}
	if _, ok := hex(s[:2]); !ok {
		return false
	}
	if zero, ok := hex(s[3:35]); !ok || zero {
		return false
	}
	if zero, ok := hex(s[36:52]); !ok || zero {
		return false
	}
	_, ok := hex(s[53:55])
	return ok
}

// TraceOptions returns the trace context of a row's decoded options: tp is
// "" when there is none or it is malformed (bad then says why), ts is ""
// when tp is or there is no valid tracestate.
func TraceOptions(opts map[string]json.RawMessage) (tp, ts, bad string) {
	raw, ok := opts[TraceparentKey]
	if !ok {
		return "", "", ""
	}
	if json.Unmarshal(raw, &tp) != nil || !ValidTraceparent(tp) {
		return "", "", "options traceparent is not a W3C traceparent: " + Truncate(string(bytes.TrimSpace(raw)), 80)
	}
	if raw, ok := opts[TracestateKey]; ok && json.Unmarshal(raw, &ts) != nil {
		ts = ""
	}
	return tp, ts, ""
}

// isTraceKey reports whether k is one of the options of the trace context.
func isTraceKey(k string) bool { return k == TraceparentKey || k == TracestateKey }

// onlyTraceKeys reports whether options holds the trace context and
// nothing else.
func onlyTraceKeys(options []byte) bool {
	var opts map[string]json.RawMessage
	if json.Unmarshal(options, &opts) != nil {
		return false
	}
	for k := range opts {
		if !isTraceKey(k) {
			return false
		}
	}
	return true
}
