package admin_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

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
		got, err := admin.ListSchemas(ctx, conn, items, table)
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

// ListSchemas refuses a list relay.ParseSchemas would refuse, as the same
// *relay.FieldError of field Schemas, before any statement; IsSchemaPattern
// tells a pattern from a name.
func TestListSchemasRefused(t *testing.T) {
	t.Parallel()
	conn := testenv.Conn(t, testenv.DatabaseURL())
	for _, items := range [][]string{nil, {""}, {"a", "a"}, {strings.Repeat("x", 64)}, {"a\x00b"}, {"a,b"}} {
		got, err := admin.ListSchemas(context.Background(), conn, items, "")
		var fe *relay.FieldError
		if !errors.As(err, &fe) || fe.Field != "Schemas" || got != nil {
			t.Errorf("ListSchemas(%q) = %q, %v; want a Schemas FieldError", items, got, err)
		}
	}
	if _, err := relay.ParseSchemas("a,a"); err == nil {
		t.Fatal("ParseSchemas(a,a) succeeded")
	} else if _, err2 := admin.ListSchemas(context.Background(), conn, []string{"a", "a"}, ""); err2 == nil || err2.Error() != err.Error() {
		t.Errorf("ListSchemas(a, a): %v; want ParseSchemas's error, %v", err2, err)
	}
	if !admin.IsSchemaPattern("tenant_*") || admin.IsSchemaPattern("tenant_1") {
		t.Error("IsSchemaPattern: want tenant_* a pattern, tenant_1 a name")
	}
}
