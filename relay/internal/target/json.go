package target

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"
)

// ReservedKeys are written from columns; options may not set them. The
// table's CHECK constraint rejects them at INSERT; decodeOptions guards
// tables migrated by hand.
var ReservedKeys = [...]string{"class", "args", "queue", "jid", "created_at", "enqueued_at", "at"}

// decodeOptions returns the fields of a row's options, or nil for the
// common "{}" without allocating.
func decodeOptions(raw []byte) (map[string]json.RawMessage, error) {
	o := bytes.TrimSpace(raw)
	if len(o) == 0 || bytes.Equal(o, []byte("{}")) {
		return nil, nil
	}
	var opts map[string]json.RawMessage
	if err := json.Unmarshal(o, &opts); err != nil || opts == nil {
		return nil, errors.New("options is not a JSON object")
	}
	for _, k := range ReservedKeys {
		if _, ok := opts[k]; ok {
			return nil, fmt.Errorf("options sets %q, which comes from a column", k)
		}
	}
	return opts, nil
}

// optionInt reads an option that must be an integer of at least least.
func optionInt(key string, v []byte, least int64) (int64, error) {
	var n int64
	if err := json.Unmarshal(v, &n); err != nil || n < least {
		if least == math.MinInt64 {
			return 0, fmt.Errorf("options %q must be an integer, got %s", key, v)
		}
		return 0, fmt.Errorf("options %q must be an integer of at least %d, got %s", key, least, v)
	}
	return n, nil
}

// Truncate cuts s to n bytes, marking the cut, for an error or a log line.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

const hexDigits = "0123456789abcdef"

// AppendJSONString appends s as a JSON string. Invalid UTF-8 becomes U+FFFD.
func AppendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				b = append(b, '\\', c)
			case c == '\n':
				b = append(b, '\\', 'n')
			case c == '\r':
				b = append(b, '\\', 'r')
			case c == '\t':
				b = append(b, '\\', 't')
			case c < 0x20:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			default:
				b = append(b, c)
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, `\ufffd`...)
		} else {
			b = append(b, s[i:i+size]...)
		}
		i += size
	}
	return append(b, '"')
}
