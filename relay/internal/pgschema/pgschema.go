// Package pgschema holds what the relay (package relay) and its admin
// operations (package relay/admin) both know of PostgreSQL: the columns
// of staged_jobs, the sidekiq-staged_push gem's table and which of its
// rows are poison, the names of the leader locks and how a group of
// relays spells its name in pg_locks, and how a list of schemas is
// matched against the database. It imports neither of them.
package pgschema

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/jackc/pgx/v5"
)

// ClaimColumns are the columns a batch reads, in the relay's scan order:
// all of staged_jobs', which staged_jobs_dead keeps too (a dead row's
// retry moves them back).
const ClaimColumns = `id, job_name, job_args, queue, run_at, jid, created_at, options`

// StagedPushTable is the sidekiq-staged_push gem's table.
const StagedPushTable = "sidekiq_staged_push_jobs"

// StagedPushPoison is true for a payload of the gem's table (as json, j) no
// worker could run: the relay's mapping's checks (mapStagedPush), in SQL,
// for the status's count of the rows the relay skips.
// TestStagedPushPoisonRulesAgree holds the two to one set of rules.
const StagedPushPoison = `(j IS NULL OR json_typeof(j) <> 'object'
	OR json_typeof(j -> 'class') IS DISTINCT FROM 'string' OR j ->> 'class' = ''
	OR json_typeof(j -> 'args') IS DISTINCT FROM 'array'
	OR (j -> 'queue' IS NOT NULL AND (json_typeof(j -> 'queue') <> 'string' OR j ->> 'queue' = ''))
	OR (j -> 'jid' IS NOT NULL AND (json_typeof(j -> 'jid') <> 'string' OR j ->> 'jid' = ''))
	OR (j -> 'at' IS NOT NULL AND json_typeof(j -> 'at') <> 'number')
	OR (j -> 'created_at' IS NOT NULL AND json_typeof(j -> 'created_at') <> 'number'))`

// LeaderLockName is the name of the leader lock of schema's relays that
// drain group ("" for every queue; else the sorted queue list, comma
// separated): one leader per name.
func LeaderLockName(schema, group string) string {
	if group == "" {
		return "stagedrain:" + schema
	}
	return "stagedrain:" + schema + ":queues=" + group
}

// GroupNameWords spells group for its name locks: its length in bytes,
// then its bytes four at a time, big-endian, the last word padded with
// zeros. Nil for the group of all queues, which needs no name.
func GroupNameWords(group string) []int32 {
	if group == "" {
		return nil
	}
	words := []int32{int32(len(group))}
	for i := 0; i < len(group); i += 4 {
		var b [4]byte
		copy(b[:], group[i:])
		words = append(words, int32(binary.BigEndian.Uint32(b[:])))
	}
	return words
}

// ReadGroupName reads back GroupNameWords's words, as pg_locks shows them
// (unsigned); ok is false when they do not spell a name.
func ReadGroupName(words []int64) (group string, ok bool) {
	if len(words) == 0 || words[0] <= 0 || (words[0]+3)/4 != int64(len(words)-1) {
		return "", false
	}
	b := make([]byte, 0, 4*(len(words)-1))
	for _, w := range words[1:] {
		if w < 0 || w > math.MaxUint32 {
			return "", false
		}
		b = binary.BigEndian.AppendUint32(b, uint32(w))
	}
	return string(b[:words[0]]), true
}

// A list of schemas (Config.Schemas, stagedrain's --schemas) has items
// that are schema names or patterns: a pattern has a '*', which matches
// any run of characters (tenant_* matches tenant_1 and tenant_acme); every
// other character matches itself ('_' and '%' included, unlike in SQL's
// LIKE).

// CheckSchemaList checks the items of a schema list: at least one, none
// empty, none PostgreSQL could not name (over 63 bytes, a NUL byte), none
// with a comma, none twice. The error says what is wrong, for the
// caller's FieldError of field Schemas.
func CheckSchemaList(items []string) error {
	if len(items) == 0 {
		return errors.New("must name at least one schema or pattern")
	}
	seen := make(map[string]bool, len(items))
	for _, s := range items {
		switch {
		case s == "":
			return errors.New("must not hold an empty item (a doubled or trailing comma?)")
		case len(s) > 63:
			return fmt.Errorf("item %.20q... is %d bytes: a PostgreSQL name has at most 63", s, len(s))
		case strings.IndexByte(s, 0) >= 0:
			return errors.New("must not contain a NUL byte")
		case strings.ContainsRune(s, ','):
			return fmt.Errorf("item %q must not contain a comma", s)
		case seen[s]:
			return fmt.Errorf("names %q twice", s)
		}
		seen[s] = true
	}
	return nil
}

// IsSchemaPattern reports whether item of a schema list is a pattern (it
// has a '*') rather than a name.
func IsSchemaPattern(item string) bool { return strings.Contains(item, "*") }

// splitSchemas sorts the items of a schema list into names and LIKE
// patterns (with '\' as LIKE's escape).
func splitSchemas(items []string) (names, like []string) {
	esc := strings.NewReplacer(`\`, `\\`, `%`, `\%`, `_`, `\_`, `*`, `%`)
	for _, s := range items {
		if IsSchemaPattern(s) {
			like = append(like, esc.Replace(s))
		} else {
			names = append(names, s)
		}
	}
	return names, like
}

// listSchemasSQL finds the schemas that a list names: $1 the names, $2 the
// LIKE patterns; $3, when not empty, a table the schema must hold (an
// ordinary or partitioned table). A pattern never matches PostgreSQL's own
// schemas (pg_*, information_schema); a name may. Sorted bytewise, so that
// every relay sees the same order.
const listSchemasSQL = `SELECT n.nspname::text FROM pg_namespace n
	WHERE (n.nspname = ANY($1::text[])
		OR (n.nspname LIKE ANY($2::text[]) AND n.nspname !~ '^pg_' AND n.nspname <> 'information_schema'))
	AND ($3 = '' OR EXISTS (SELECT FROM pg_class c
		WHERE c.relnamespace = n.oid AND c.relname = $3 AND c.relkind IN ('r', 'p')))
	ORDER BY n.nspname COLLATE "C"`

// Querier runs a query: a *pgx.Conn, a *pgxpool.Pool or a pgx.Tx.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// ListSchemas returns the schemas of the database that items (checked
// with CheckSchemaList) name, sorted bytewise. With table set (such as
// "staged_jobs"), only schemas that hold a table of that name; with table
// "", every schema that exists. A name that matches no schema is left
// out.
func ListSchemas(ctx context.Context, q Querier, items []string, table string) ([]string, error) {
	names, like := splitSchemas(items)
	rows, err := q.Query(ctx, listSchemasSQL, names, like, table)
	if err != nil {
		return nil, fmt.Errorf("list schemas: %w", err)
	}
	defer rows.Close()
	var found []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			return nil, fmt.Errorf("list schemas: %w", err)
		}
		found = append(found, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list schemas: %w", err)
	}
	return found, nil
}
