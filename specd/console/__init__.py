"""The web console the daemon serves at ``/ui``: the cluster at a glance, live figures, a
playground and apply. Its front end is plain ES modules (Preact and htm, vendored) in
``static/``: nothing to build, nothing fetched from outside the daemon."""
