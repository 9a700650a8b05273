package relay

import (
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Migration 018 writes staged_jobs.id's default out as the expression
// 011's stagedrain_next_id() was inlined into: PostgreSQL parsed that
// function's body again for every INSERT it planned. The default takes the
// transaction id before nextval() as before; the relay's mark accepts it
// and 011's form, both of the column's own sequence, and nothing else. 018
// replaces only 011's default: one an app set itself stays.
func TestIDDefaultIsInline(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r, conn, schema, pcfg := markRelay(t, "iddefault")
	table := pgx.Identifier{schema, "staged_jobs"}.Sanitize()
	seq := pgx.Identifier{schema, "staged_jobs_id_seq"}.Sanitize()
	other := pgx.Identifier{schema, "other_seq"}.Sanitize()
	nextID := pgx.Identifier{schema, "stagedrain_next_id"}.Sanitize()
	if _, err := conn.Exec(ctx, "CREATE SEQUENCE "+other); err != nil {
		t.Fatal(err)
	}
	space := regexp.MustCompile(`\s+`)
	idDefault := func() string {
		t.Helper()
		var d string
		if err := conn.QueryRow(ctx, `SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d
			JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
			WHERE d.adrelid = $1::regclass AND a.attname = 'id'`, table).Scan(&d); err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(space.ReplaceAllString(d, " "))
	}
	setDefault := func(expr string) {
		t.Helper()
		if _, err := conn.Exec(ctx, "ALTER TABLE "+table+" ALTER COLUMN id SET DEFAULT "+expr); err != nil {
			t.Fatal(err)
		}
	}
	// remigrate runs 018 again on the table as it is now.
	remigrate := func() {
		t.Helper()
		if _, err := conn.Exec(ctx, "DELETE FROM "+pgx.Identifier{schema, "stagedrain_migrations"}.Sanitize()+" WHERE version = 18"); err != nil {
			t.Fatal(err)
		}
		if _, err := Migrate(ctx, conn, schema); err != nil {
			t.Fatal(err)
		}
	}

	inline := "CASE WHEN (pg_current_xact_id() IS NOT NULL) THEN nextval('" + schema + ".staged_jobs_id_seq'::regclass) ELSE NULL::bigint END"
	if got := idDefault(); got != inline {
		t.Fatalf("staged_jobs.id's default after Migrate = %q, want %q", got, inline)
	}
	// The ids come from the table's own sequence, one at a time.
	var id1, id2 int64
	if err := conn.QueryRow(ctx, "INSERT INTO "+table+" (job_name, job_args) VALUES ('J', '[]') RETURNING id").Scan(&id1); err != nil {
		t.Fatal(err)
	}
	if err := conn.QueryRow(ctx, "INSERT INTO "+table+" (job_name, job_args) VALUES ('J', '[]') RETURNING id").Scan(&id2); err != nil {
		t.Fatal(err)
	}
	var last int64
	if err := conn.QueryRow(ctx, "SELECT last_value FROM "+seq).Scan(&last); err != nil || id2 != id1+1 || last != id2 {
		t.Fatalf("ids %d, %d; the sequence's last value %d (%v): want consecutive ids from the table's own sequence", id1, id2, last, err)
	}

	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	markOn := func() bool {
		t.Helper()
		mark, err := r.newLowWater(ctx, pool)
		if err != nil {
			t.Fatal(err)
		}
		return mark != nil
	}

	if !markOn() {
		t.Fatal("no low-water mark with 018's default")
	}
	for _, c := range []struct {
		name, expr string
		mark       bool
	}{
		{"011's function of the table's sequence", nextID + "('" + seq + "')", true},
		{"018's expression of another sequence", "CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval('" + other + "') END", false},
		{"011's function of another sequence", nextID + "('" + other + "')", false},
		{"a plain nextval() of the table's sequence", "nextval('" + seq + "')", false},
		{"018's expression, the other way round", "CASE WHEN nextval('" + seq + "') IS NOT NULL THEN pg_current_xact_id()::text::bigint END", false},
	} {
		setDefault(c.expr)
		if got := markOn(); got != c.mark {
			t.Errorf("with %s as the id's default (%s), the mark is on: %v, want %v", c.name, idDefault(), got, c.mark)
		}
	}

	// 018 on a table of 017: 011's default becomes the expression.
	setDefault(nextID + "('" + seq + "')")
	remigrate()
	if got := idDefault(); got != inline {
		t.Errorf("018 left 011's default as %q, want %q", got, inline)
	}
	// 018 on a table whose app set its own default: left alone.
	setDefault("nextval('" + seq + "')")
	remigrate()
	if got := idDefault(); !strings.HasPrefix(got, "nextval(") {
		t.Errorf("018 changed an app's own default to %q", got)
	}
}
