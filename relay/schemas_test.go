package relay_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/stagedrain/stagedrain/relay"
)

func TestParseSchemas(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
		err  string
	}{
		{in: "a", want: []string{"a"}},
		{in: " tenant_* , public ", want: []string{"tenant_*", "public"}},
		{in: `Ten"ant,ünï`, want: []string{`Ten"ant`, "ünï"}},
		{in: "", err: "empty item"},
		{in: "a,,b", err: "empty item"},
		{in: "a,", err: "empty item"},
		{in: "a,a", err: `names "a" twice`},
		{in: strings.Repeat("x", 64), err: "at most 63"},
		{in: "a\x00b", err: "NUL"},
	} {
		got, err := relay.ParseSchemas(tc.in)
		if tc.err != "" {
			var fe *relay.FieldError
			if !errors.As(err, &fe) || fe.Field != "Schemas" || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseSchemas(%q) = %v, %v; want a Schemas error with %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("ParseSchemas(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}
