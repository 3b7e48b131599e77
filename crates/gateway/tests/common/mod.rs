pub mod api_server;
