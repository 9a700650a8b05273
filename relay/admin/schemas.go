package admin

import (
	"context"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/pgschema"
)

// ListSchemas returns the schemas of the database that items (names and
// patterns, as relay.ParseSchemas returns them) name, sorted bytewise, as
// a relay with relay.Config.Schemas finds them. With table set (such as
// "staged_jobs"), only schemas that hold a table of that name; with table
// "", every schema that exists. A name that matches no schema is left
// out, not an error: the caller says what it needs of it. Items that are
// not a valid list are a *relay.FieldError of field Schemas.
func ListSchemas(ctx context.Context, db DB, items []string, table string) ([]string, error) {
	if err := pgschema.CheckSchemaList(items); err != nil {
		return nil, &relay.FieldError{Field: "Schemas", Reason: err.Error()}
	}
	return pgschema.ListSchemas(ctx, db, items, table)
}

// IsSchemaPattern reports whether item of a schema list is a pattern (it
// has a '*', which matches any run of characters) rather than a name.
func IsSchemaPattern(item string) bool { return pgschema.IsSchemaPattern(item) }
