package relay_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
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

// TestListSchemas matches names and patterns against real schemas: '*' is
// the only wildcard ('_' and '%' match themselves), a pattern never
// matches PostgreSQL's own schemas, and with a table only schemas holding
// it are listed.
func TestListSchemas(t *testing.T) {
	ctx := context.Background()
	conn := testenv.Conn(t, testenv.DatabaseURL())
	base := testenv.Name("sdls")
	a := testenv.SchemaNamed(t, base+"_a")
	b := testenv.SchemaNamed(t, base+"_b")
	odd := testenv.SchemaNamed(t, base+"x%y")  // matched by *, not by _ or %
	under := testenv.SchemaNamed(t, base+"xb") // "_b" must not match "xb"
	for _, s := range []string{a, b} {
		if _, err := relay.Migrate(ctx, conn, s); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range []string{odd, under} {
		if _, err := conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{s}.Sanitize()); err != nil {
			t.Fatal(err)
		}
	}
	list := func(items []string, table string) []string {
		t.Helper()
		got, err := relay.ListSchemas(ctx, conn, items, table)
		if err != nil {
			t.Fatalf("ListSchemas(%q, %q): %v", items, table, err)
		}
		return got
	}
	if got, want := list([]string{base + "*"}, ""), []string{a, b, odd, under}; !slices.Equal(got, want) {
		t.Errorf("pattern %s*: got %q, want %q", base, got, want)
	}
	if got, want := list([]string{base + "*"}, "staged_jobs"), []string{a, b}; !slices.Equal(got, want) {
		t.Errorf("pattern with table: got %q, want %q", got, want)
	}
	if got, want := list([]string{base + "_*"}, ""), []string{a, b}; !slices.Equal(got, want) {
		t.Errorf("'_' must match only '_': got %q, want %q", got, want)
	}
	if got, want := list([]string{base + "x%y", b, base + "_missing"}, ""), []string{b, odd}; !slices.Equal(got, want) {
		t.Errorf("names: got %q, want %q", got, want)
	}
	if got := list([]string{"pg_*", "information*"}, ""); len(got) != 0 {
		t.Errorf("a pattern matched PostgreSQL's own schemas: %q", got)
	}
	if got := list([]string{"pg_catalog"}, ""); !slices.Equal(got, []string{"pg_catalog"}) {
		t.Errorf("a name must match even PostgreSQL's own schema: %q", got)
	}
}
